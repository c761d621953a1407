"""The `kvserve` subcommands a user starts a job with: `generate` and `bench throughput`
(generate.py), `chat` (chat.py), `serve` (serve.py: one server, or N replicas behind the router).
kvserve/cli.py wires them, with the planning, quality and fleet commands, into one parser."""
