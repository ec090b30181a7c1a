"""renderers"""
