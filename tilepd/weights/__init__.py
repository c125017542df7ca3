"""tilepd.weights"""
