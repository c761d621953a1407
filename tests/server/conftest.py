"""The live-server modules' shared fixture: `client`, the official SDK against the module's own
`server` (a LiveServer fixture each module starts with its flags). A module that means another
client by the name defines its own."""
from __future__ import annotations

import pytest

from .live import openai_client


@pytest.fixture(scope="module")
def client(server):
    c = openai_client(server)
    yield c
    c.close()
