"""pisft.train"""
