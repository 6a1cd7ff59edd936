"""What both sides of `steadytrain run` agree on, and how a run directory is written: the
supervisor (torch-free, it imports nothing of training) and its child (the Trainer, the safety
callbacks, the integrations) each import these, and no other of their parts, to talk through
the run directory and the environment. Standard library only.

files.py     every file and folder a run writes, by name (config.json, events.jsonl, ...)
env.py       the STEADYTRAIN_* variables the supervisor sets for its child, and their one reader
records.py   the registries of record names in events.jsonl (`Record`) and of the keys of a
             metrics.jsonl line (`Metric`), for every writer and reader
events.py    appending an event line from a process that does not hold the file open
jsonl.py     JSON-lines files: a line written whole, lines read back past a torn one
hangs.py     the heartbeat, hang reports, the backstop's stack dumps turned into reports
savers.py    the memory savers' registry: names, ladder order, words, config keys
durable.py   writes that survive a power cut, never through a planted link; a full disk named
"""
