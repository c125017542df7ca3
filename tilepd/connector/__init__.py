"""tilepd.connector"""
