"""worker: the Celery app and thin tasks that wire gspo_core's trainer to store/."""
