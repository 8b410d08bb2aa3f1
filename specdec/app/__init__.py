"""The application around the services: `specdec up` (launcher: redis-server and the three
services as processes on loopback) and `specdec up` / `specdec client` command lines (cli_commands)."""
