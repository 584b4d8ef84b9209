"""worker/models"""
