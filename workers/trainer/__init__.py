"""workers/trainer"""
