"""The engine contract (``treadle.common.engine``), below both server and workers.

Every call a server makes on an engine (``messages``: one class a call, with its
result, whether it is ordered and which storage paths it stages), the domain
types they carry (``domain``), the API that runs them (``api``), their codec
for the Celery transport (``codec``), the stats an engine reports (``stats``),
the losses as callers know them (``losses``) and a model's shape
(``model_config``). Importing it needs neither torch nor any server library
(a test keeps that).
"""
