"""tilepd.dev"""
