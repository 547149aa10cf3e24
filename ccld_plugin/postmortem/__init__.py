"""After the job: diagnosis and a timeline from the boards it left (live or dead).

boards (read and check one job's boards) -> diagnose_boards (the live diagnoser's analysis,
one round over them) and timeline (a Trace Event file for Perfetto / chrome://tracing).
"""
