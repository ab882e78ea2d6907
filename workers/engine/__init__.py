"""workers/engine"""
