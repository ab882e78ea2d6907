"""server/celery"""
