"""tilepd.router"""
