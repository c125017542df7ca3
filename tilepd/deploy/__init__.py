"""tilepd.deploy"""
