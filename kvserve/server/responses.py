"""`POST /v1/responses` (being built; installs nothing yet)."""


def install(app, state) -> None:
    return None
