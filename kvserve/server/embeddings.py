"""`POST /v1/embeddings` (being built; installs nothing yet)."""


def install(app, state) -> None:
    return None
