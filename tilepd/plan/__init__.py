"""tilepd.plan"""
