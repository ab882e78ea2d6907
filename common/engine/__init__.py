"""common/engine"""
