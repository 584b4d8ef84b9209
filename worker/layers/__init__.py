"""worker/layers"""
