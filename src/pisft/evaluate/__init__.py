"""pisft.evaluate"""
