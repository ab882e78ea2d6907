"""server/rpc"""
