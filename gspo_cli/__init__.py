"""The `gspo` command: local training, the service's commands, and the API client's commands."""
