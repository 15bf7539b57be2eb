"""`tokenmill batch`: OpenAI Batch API files run in-process (`runner.py`), one line parsed by `requests.py`."""
