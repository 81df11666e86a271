"""In-engine data parallelism: the dispatch policies (`dispatch`) and the controller process."""
