"""pisft.bench"""
