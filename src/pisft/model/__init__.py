"""pisft.model"""
