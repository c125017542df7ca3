"""tilepd.runtime"""
