"""the chat page at `/` (being built; installs nothing yet)."""


def install(app, state) -> None:
    return None
