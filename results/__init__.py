"""The result channel shared by the API and the worker.

One Redis stream per job (results.events: entry format), a hash of finished samples
(results.store), the job's progress hash (results.keys), a publisher the worker writes
through, a reader that resumes from a stream id, and an HTTP client (results.client).
"""
