"""Gradient buckets: which parameters share a bucket (:mod:`.layout`), one bucket's flat buffer (:mod:`.bucket`), the
buffers' reduction overlapped with backward (:mod:`.buckets`), the statistics (:mod:`.stats`), and the gradient
synchronisation a strategy holds (:mod:`.sync`).
"""

from lightning_dp_strategies.bucketing.bucket import Bucket
from lightning_dp_strategies.bucketing.buckets import GradientBuckets
from lightning_dp_strategies.bucketing.layout import assign_buckets, bucket_boundaries
from lightning_dp_strategies.bucketing.stats import CommStats
from lightning_dp_strategies.plan.sizing import MiB

__all__ = ["Bucket", "CommStats", "GradientBuckets", "MiB", "assign_buckets", "bucket_boundaries"]
