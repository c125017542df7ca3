"""tilepd.transport"""
