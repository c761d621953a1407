"""the request and stats log lines (being built; installs nothing yet)."""


def install(app, state) -> None:
    return None
