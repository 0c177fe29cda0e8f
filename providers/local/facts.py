"""What the local market *is*, as data (no SDK, nothing imported from the provider): read by `elastic.record.billing`."""

from providers.base import BillingTerms

BILLING = BillingTerms(minimum_s=0.0, increment_s=1.0)   # the simulated market bills per second from the first
