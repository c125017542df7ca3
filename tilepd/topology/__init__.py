"""tilepd.topology"""
