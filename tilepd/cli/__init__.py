"""tilepd.cli"""
