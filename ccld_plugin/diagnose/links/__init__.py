"""Links: what the ranks' connections say. Where a hang's TCP or NCCL channels put it
(``tcp_evidence``, ``nccl_evidence``); slow links and ports over windows of channel reports
(``link_stats``, ``link_roles``, ``ports``, ``slow_links``); pipelines' messages paired end
to end (``p2p_transfers``), the slow port or link they show (``slow_messages``), judged
beside the channels (``pipeline_links``); and the slow detector's communication verdicts
(``slow_communication``)."""
