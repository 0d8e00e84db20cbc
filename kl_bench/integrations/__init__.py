"""Trainer integrations built on kl_bench.audit: ``kl_bench.integrations.trl.KLAudit`` (needs the trl extra)."""
