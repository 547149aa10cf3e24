"""What a rank starts beside training: its ``session`` (enable, mark_step, disable), the
agent and the diagnoser or its standby (``rank_services``), the ``diagnoser`` thread and
what it costs its rank (``diagnosis_load``), its ``standby``, and the diagnoser as a
process of its own (``diagnoser_process``)."""
