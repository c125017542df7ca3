"""tilepd.control"""
