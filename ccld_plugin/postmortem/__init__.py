"""After the job: diagnosis and a timeline from the boards it left (live or dead).

boards (read and check one job's boards) -> diagnose_boards (the live diagnoser's analysis,
one round over them), inspect_boards (what ``ccld inspect`` prints) and timeline (a Trace
Event file for Perfetto / chrome://tracing); replay (``ccld replay`` of a recording).
"""
