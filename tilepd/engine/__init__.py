"""tilepd.engine"""
