"""pisft.workflow"""
