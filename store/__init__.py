"""store: persistence shared by the API and the worker (database, object storage, job state)."""
