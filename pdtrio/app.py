"""``hypercorn -k trio pdtrio.app:app``: the OpenAI-compatible PD router."""

from pdtrio.router.app import RouterApp

app = RouterApp()
