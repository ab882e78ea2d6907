"""workers/worker"""
