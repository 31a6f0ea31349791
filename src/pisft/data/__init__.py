"""pisft.data"""
