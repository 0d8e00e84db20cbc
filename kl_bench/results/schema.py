"""Every table kl-bench stores, as data: column → meaning, in the files' column order (docs/results.md).

The one place a column is declared: writers select these columns, readers (:mod:`kl_bench.results.verify`)
check them. No torch, no engine: reading a results folder never loads the machinery that wrote it.
"""
from __future__ import annotations

# The results folder's format, recorded in run.json as "kl_bench_run" (kl_bench.results.migrate reads
# every older version; a newer one is refused). History:
#   1: every folder written before the version meant anything: summary.csv may lack columns added since
#      (they are filled in when read: empty text, NaN numbers).
#   2: summary.csv holds every column of SCHEMA.
#   3: summary.csv adds ess (degenerate importance weights: their SE and z are empty, heavy_tail says so),
#      ref_diff and ref_diff_se (the bias against a Monte Carlo reference and the SE that z_ref divides by);
#      n_for_10pct and rmse_b* are empty, not inf, where the truth is unknown.
FORMAT_VERSION = 3

# Column → meaning. The order here is the column order of summary.csv.
SCHEMA: dict[str, str] = {
    "case": "case name from the spec",
    "kind": "case kind: gaussian | categorical | rollout",
    "estimator": "estimator name from the registry (kl-bench list)",
    "lambda": "λ of the control variate cv(λ); empty for other estimators",
    "aggregate": "rollouts: seq (estimator of L = Σ log r_t; k3 uses R = e^L), tok (per-token estimator "
                 "summed over the generated tokens), tok_mean (that sum / |y|), tok_batch (token-mean over a "
                 "trainer batch of B sequences: Σ over its tokens / their number; one value per batch of B, "
                 "so std, frac_negative and the planning columns are per batch of B), tok_gm (the sum times "
                 "TRL's geometric sequence weight); empty for single draws",
    "target": "what the estimator estimates: KL(q||p) or KL(p||q)",
    "true_kl": "exact value of the target; tok_mean and tok_batch rows (divided by lengths): the target per "
               "generated token, true value / E_q|y|, which a token-mean of any unbiased per-token estimator "
               "tends to",
    "draws": "number of Monte Carlo draws x ~ q (tok_batch rows: the draws in whole batches of B)",
    "batches": "number of batches used for the batch-means standard error",
    "mean": "Monte Carlo mean of the estimator over all draws",
    "std": "Monte Carlo standard deviation of one draw's estimate (tok_batch: of one batch of B's value)",
    "se": "standard error of `mean`, from batch means",
    "std_se": "standard error of `std` (batch means of the squared deviations from the exact mean, delta method)",
    "bias": "mean − true_kl",
    "rel_bias": "bias / true_kl (empty when true_kl is 0 or inf)",
    "rel_std": "std / true_kl: per-draw noise relative to the truth (Schulman's stdev/true)",
    "exact_mean": "exact E_q[estimator] (closed form or exact sum)",
    "exact_std": "exact per-draw standard deviation; inf when the variance diverges",
    "exact_rel_bias": "(exact_mean − true_kl) / true_kl",
    "exact_rel_std": "exact_std / true_kl",
    "z": "(mean − exact_mean) / se: |z| < 5 is agreement with the exact value",
    "z_var": "(Σ(f − exact_mean)²/N − exact_std²) / its batch-means SE: the variance against the exact one",
    "frac_negative": "fraction of draws whose estimate is < 0 (tok_batch rows: of groups of B)",
    "sampler": "how draws were made when not from q (temperature, top-k/p, EOS suppression, stale policy, "
               "IS weights); empty for x ~ q. exact_mean is then E_b of the estimator, bias against KL(q||p)",
    "support_miss": "mass of q (worst context or step) that the sampler never draws; > 0 biases every estimate",
    "heavy_tail": "'degenerate IS weights (ESS < batches)' (the importance weights' effective sample size, "
                  "ess, is below the number of batches: the mean is unknown, se, std_se, z and z_var are empty), "
                  "'infinite variance' or 'infinite 4th moment' (exact: the measured std is unreliable, "
                  "usually too low), 'kurtosis > draws' (the exact E[v⁴]/E[v²]² of the row's value exceeds the "
                  "draws, so the measured std is unreliable), 'infinite IS weight (b misses q's support)' (weighted rows of a "
                  "sampler that never draws some of q's mass), 'unstable batches' (one batch carries most of Σ(f − c)²), "
                  "or empty",
    "ess": "rows multiplied by the draw's importance weight W (a sampler b ≠ q with weights): Kish's effective "
           "sample size (ΣW)²/ΣW² of the draws' weights (0 when every weight underflows float64), or N·std²/exact_std² "
           "where that is below the batches (the draws never met the weights that make the exact variance; 0 "
           "where every draw gave one value); empty elsewhere",
    "lambda_star": "cv rows: exact variance-optimal λ* = Cov(log r, r)/Var(r) (empty if unknown)",
    "lambda_star_mc": "cv rows: empirical λ* from this run's draws",
    "lambda_star_mc_se": "cv rows: standard error of lambda_star_mc (batch jackknife; unreliable when "
                         "E_q[r⁴] = ∞, see heavy_tail of cv rows)",
    "excess_std": "cv rows: exact_std at this λ / exact_std at λ* − 1 (0 at the optimum)",
    "n_for_10pct": "draws a batch needs for its mean to be within 10% of true_kl with 95% probability "
                   "(normal approximation, exact bias and std where known; inf if the bias alone exceeds 10%; "
                   "1 where true_kl = 0 and every draw is exactly 0; empty where true_kl is unknown; "
                   "tok_batch rows: B × the groups needed)",
    "rmse_b64": "root-mean-square error of a batch mean of 64 draws, bias included (tok_batch rows: of the "
                "mean of 64/B batch values; empty when B > 64 or true_kl is unknown)",
    "rmse_b1024": "the same for 1024 draws",
    "rmse_b16384": "the same for 16384 draws",
    "p_neg_b64": "probability that a batch mean of 64 draws is negative, simulated on min(4096, max(256, "
                 "draws/256)) batches of 64 independent draws (tok_batch rows: the mean of max(1, 64/B) "
                 "consecutive batch values)",
    "ref_kl": "cases without an exact value (model continuations, logged log-probs): the reference for KL(q||p), "
              "the measured mean of the Rao–Blackwellised `full` row (Monte Carlo, NOT exact); empty elsewhere",
    "ref_se": "standard error of ref_kl (batch means; logged log-probs: std over the logged sequences / √B)",
    "ref_diff": "KL(q||p) rows of cases with ref_kl: the row's mean − ref_kl, its bias against the reference as the "
                "data say it (logged log-probs: the log's own means, exact over the logged sequences, not the "
                "resampled mean)",
    "ref_diff_se": "standard error of ref_diff: batch means of the paired difference (same paths); logged log-probs: "
                   "std of the per-sequence difference over the logged sequences / √B, never the resampling SE",
    "z_ref": "ref_diff / ref_diff_se (with the rounding floor): |z_ref| < 5 is agreement with the reference; "
             "KL(q||p) rows only",
}
COLUMNS = list(SCHEMA)
# Cases made by [[sweep]] tables (kl_bench.experiment.sweeps.expand_sweeps) add one column per swept key after the
# columns above, named SWEEP_PREFIX + key (e.g. "sweep.p.noise", "sweep.sampler.temperature"): the key's
# value in that case, empty for a case not swept over it. A spec without [[sweep]] has none.
SWEEP_PREFIX = "sweep."
# `kl-bench exact` / kl_bench.exact(): the columns that need no sampling (planning from exact moments).
MEASURED = {"draws", "batches", "mean", "std", "se", "std_se", "bias", "rel_bias", "rel_std", "z", "z_var",
             "frac_negative", "lambda_star_mc", "lambda_star_mc_se", "p_neg_b64", "heavy_tail", "excess_std", "ess"}
EXACT_COLUMNS = [c for c in COLUMNS if c not in MEASURED]
# Text columns of every results CSV: read as strings, empty cells as "" (not NaN).
TEXT_COLUMNS = ["case", "kind", "estimator", "aggregate", "target", "heavy_tail", "sampler", "mode", "equals", "baseline",
                "gate", "formula"]


# batches.csv: one row per (case, row, batch): the batch means behind every standard error.
BATCH_SCHEMA: dict[str, str] = {
    "case": "case name", "estimator": "estimator", "lambda": "λ for cv rows", "aggregate": "rollout aggregation",
    "batch": "batch index (draws of batch i are seeded from (seed, case, i))",
    "draws": "draws in this batch", "batch_mean": "mean of the estimator over the batch's draws",
}


# lambda_sweep.csv: cv(λ) = −log r + λ(r − 1) over the λ grid, per case and aggregate.
SWEEP_SCHEMA: dict[str, str] = {
    "case": "case name",
    "aggregate": "rollouts: seq (R = e^L) or tok (per-token sums); empty for single draws",
    "lambda": "λ of cv(λ) = −log r + λ(r − 1); λ = 0 is k1, λ = 1 is k3",
    "true_kl": "exact KL(q||p), the target of every λ",
    "mean": "Monte Carlo mean of cv(λ), from the joint moments of one pass",
    "se": "its batch-means standard error",
    "std": "Monte Carlo per-draw standard deviation of cv(λ)",
    "rel_std": "std / true_kl",
    "exact_mean": "exact E_q[cv(λ)] (= KL(q||p) when supp p ⊆ supp q)",
    "exact_std": "exact per-draw standard deviation (inf for λ ≠ 0 when χ²(p||q) = ∞)",
    "exact_rel_std": "exact_std / true_kl",
    "p_negative_exact": "exact P_q(cv(λ) < 0) (categoricals; empty where no exact method exists)",
    "frac_negative": "measured fraction of negative draws, on the spec's coarser λ grid only",
    "lambda_star": "exact variance-optimal λ* = Cov(log r, r)/Var(r)",
    "lambda_star_mc": "empirical λ* from the same draws",
}


# gates.csv: one row per (case, gate, delta) with `[experiment] gates` (kl_bench.core.gates): a threshold on a
# per-token statistic used as a mask, and what it costs, exactly (sums over each context's vocabulary).
GATE_SCHEMA: dict[str, str] = {
    "case": "case name (a categorical or rollout case)",
    "gate": "the statistic s of the sampled token x ~ q (bin_kl, bin_tv, k3, ratio: docs/gates.md); the token is "
            "masked when s > delta",
    "formula": "the mask's condition",
    "delta": "the threshold δ",
    "tokens_masked": "share of generated tokens masked (rollouts: E_q[#masked] / E_q|y|)",
    "seq_masked": "rollouts: share of sequences with at least one masked token; empty for single tokens",
    "worst_context": "the largest share of tokens masked in any one context",
    "kl_unseen": "share of KL(q||p) carried by the masked tokens (each context's KL split over its tokens by k3 "
                 "= r − 1 − log r, parts ≥ 0 that sum to it)",
    "k1_bias": "relative bias of k1 summed over the kept tokens only: −E_q[k1·1{masked}] / KL(q||p)",
    "k3_bias": "the same for k3: −kl_unseen",
    "weight_bias": "E_q[r·1{kept}] − 1 per token = −P_p(masked): the mean the policy gradient's importance weight "
                   "r = p/q loses",
    "seq_kl_unseen": "rollouts, a masked token masking its whole sequence (a sequence mask, as Trust Region Masking): "
                     "the share of KL(q||p) the masked sequences carry; empty for single tokens",
    "seq_weight_bias": "rollouts: E_q[W·1{sequence kept}] − 1 = −P_p(sequence masked), the mean the sequence weight "
                       "W = Π_t r_t loses under that mask; empty for single tokens",
    "sees": "E_q[statistic] / its divergence (KL(q||p) for bin_kl, k3 and topk_kl@K; TV(q,p) for bin_tv and "
            "topk_tv@K): the share of the divergence the statistic sees; empty for ratio",
}


# group_baselines.csv: one row per (case, estimator, aggregate, baseline, group) with `[experiment] baseline_groups`
# (kl_bench.experiment.group_baselines): the reward-mode gradient (f − b)·s with a group baseline b over G draws.
GROUP_BASELINE_SCHEMA: dict[str, str] = {
    "case": "case name (a categorical or rollout case)",
    "sampler": "the case's sampler, empty when x ~ q: the groups are drawn from b, each draw's f − b multiplied "
               "by its (corrected) weight q/b where the sampler has token weights",
    "estimator": "estimator f in the reward",
    "aggregate": "rollouts: seq (F = f(L), L the sequence log-ratio) or tok (F = Σ_t f_t); empty for categoricals",
    "mode": "reward (the baseline centres the reward: the per-draw gradient is ρ·(F − b)·∇θ log q)",
    "baseline": "group_mean (GRPO: minus the group's mean, the draw included) or leave_one_out (RLOO: minus "
                "the mean of the other G − 1)",
    "group": "G, draws per group (one prompt's samples)",
    "draws": "Monte Carlo draws, whole groups",
    "exact_shrink": "|E[ρ(f − b)s]| / |E[ρ f s]| (ρ the weight, 1 without one), exact: 1 − 1/G for group_mean "
                    "and 1 for leave_one_out where E[ρ s] = 0 (x ~ q, or weights that undo a full-support sampler); "
                    "a truncating sampler (top-k, top-p, a mask) leaves E[ρ s] ≠ 0, and the baseline's mean moves it",
    "mc_along_reverse": "Monte Carlo mean of the per-draw gradient along the unit ∇KL(q||p)",
    "exact_along_reverse": "its exact value",
    "z_reverse": "(MC − exact) along ∇KL(q||p), in batch-means standard errors",
    "mc_second": "Monte Carlo E|g|²",
    "exact_second": "exact E|g|²",
    "z_second": "(MC − exact) of E|g|², in batch-means standard errors",
    "trace_cov": "measured trace of the per-draw gradient covariance with the baseline: mc_second − |exact E g|²",
    "trace_cov_none": "the same with no baseline, from the same draws",
    "exact_trace_cov": "exact trace of the per-draw gradient covariance with the baseline (NaN on rollouts: "
                       "their second moments are measured)",
    "exact_trace_cov_none": "the same with no baseline",
    "variance_ratio": "exact_trace_cov / exact_trace_cov_none where exact, else trace_cov / trace_cov_none: below 1 "
                      "where the baseline reduces the variance",
}


# gradients.csv: one row per (case, estimator, aggregate, λ, mode) with gradient rows on.
GRAD_SCHEMA: dict[str, str] = {
    "case": "case name", "estimator": "estimator (or clamped variant label)",
    "aggregate": "rollouts: seq (estimator of the sequence log-ratio L), tok (per-token estimator summed over "
                 "tokens), tok_mean (that sum over |y|), tok_batch (token-mean over B sequences; one gradient "
                 "per group); see kl_bench.kinds.rollout.gradients; empty for Gaussians and categoricals",
    "lambda": "λ for cv rows",
    "sampler": "the case's sampler, empty when x ~ q: draws come from b, and with importance weights every "
               "per-draw gradient is multiplied by the detached q/b (rollouts: per token or per sequence)",
    "mode": "the gradient mode: where the trainer puts the estimator (one entry of kl_bench.core.modes.MODES)",
    "params": "number of parameters θ (categorical: B·V logits; Gaussian: 2 per dimension; rollout: C·V logits)",
    "draws": "Monte Carlo draws",
    "equals": "what the exact expected gradient equals: reverse (∇KL(q||p)), forward (∇KL(p||q)), zero, ukl "
              "(∇ of the unnormalised KL over what the sampler can draw), self (∇E_q of the row's own value), "
              "other; rows divided by lengths (tok_mean) against the KL gradients over E_q|y|",
    "cos_reverse": "cosine of the Monte Carlo mean gradient with the exact ∇KL(q||p)",
    "cos_forward": "cosine of the Monte Carlo mean gradient with the exact ∇KL(p||q)",
    "relerr_reverse": "|mean gradient − ∇KL(q||p)| / |∇KL(q||p)| (Monte Carlo)",
    "relerr_forward": "|mean gradient − ∇KL(p||q)| / |∇KL(p||q)| (Monte Carlo)",
    "exact_cos_reverse": "cosine of the exact expected gradient with ∇KL(q||p)",
    "exact_cos_forward": "cosine of the exact expected gradient with ∇KL(p||q)",
    "exact_relerr_reverse": "|E[gradient] − ∇KL(q||p)| / |∇KL(q||p)| (exact)",
    "exact_relerr_forward": "|E[gradient] − ∇KL(p||q)| / |∇KL(p||q)| (exact)",
    "z_reverse": "(MC − exact) of the gradient's component along ∇KL(q||p), in batch-means standard errors",
    "z_forward": "the same along ∇KL(p||q)",
    "trace_cov": "per-draw gradient variance: trace of its covariance (Monte Carlo)",
    "exact_trace_cov": "the same, exact (empty on rollouts: no exact second moments)",
    "z_trace": "(E|g|² measured − exact) in batch-means standard errors; empty where E|g|⁴ = ∞ (Gaussian rows "
               "whose coefficient has an r term when E_q[r⁴] = ∞): there the measured trace cannot be trusted",
    "n_for_cos90": "batch size for cosine ≥ 0.9 with ∇KL(q||p) with 95% probability (normal approximation, "
                   "exact moments; rollouts: exact mean, measured variances); inf when the expectation itself is "
                   "not within 0.9 or the per-draw variance is infinite; empty without an exact mean",
    "exact_along_reverse": "exact E[gradient]·u, u the unit vector along ∇KL(q||p) (for the cosine-vs-batch plot)",
    "exact_norm": "|E[gradient]| (exact)",
}


# ----------------------------------------------------------------------------- a training folder (kl-bench train)
# train.csv: column → meaning (docs/training.md).
TRAIN_SCHEMA: dict[str, str] = {
    "case": "case name",
    "combination": "estimator/mode[/aggregate] as written in [train] combinations",
    "estimator": "estimator (registry name, plug-in or library preset)",
    "mode": "where the trainer puts it: one entry of kl_bench.core.modes.MODES (loss, reward, loss_is, straight_through, "
            "loss_is_nemo, reward+loss, reward_to_go, reward_partial)",
    "aggregate": "rollouts: tok (per-token estimator summed along the path) or seq (estimator of the sequence "
                 "log-ratio); empty for categoricals",
    "gradients": "exact (the expected update: a deterministic trajectory) or sampled (n draws a step; the values "
                 "are means over the seeds)",
    "draws": "draws per step (0 for exact trajectories)",
    "seeds": "sampled trajectories averaged (1 for exact)",
    "step": "optimiser steps taken before this row's state (0: the initial policy)",
    "kl_rev": "KL(q||p) of the policy, exact (categorical: mean over contexts; rollout: over sequences)",
    "kl_fwd": "KL(p||q), exact",
    "entropy": "entropy of q in nats, exact (rollout: of the sequence)",
    "reward": "E_q[reward], exact (rollout: of the summed reward)",
    "objective": "J = E_q[reward] − β KL(q||p), exact",
    "kl_opt": "KL(q||q*), q* ∝ p·exp(reward/β) the maximiser of J, exact: the distance to the true optimum",
    "grad_norm": "|update direction| taken from this state (sampled: mean over seeds)",
    "cos_true": "cosine of the update direction with ∇J (empty where ∇J = 0 or the update is 0; sampled: mean)",
    "kl_rev_sd": "sampled: standard deviation of kl_rev across seeds (the band); empty for exact rows",
    "kl_fwd_sd": "sampled: the same for kl_fwd",
    "entropy_sd": "sampled: the same for entropy",
    "reward_sd": "sampled: the same for reward",
    "objective_sd": "sampled: the same for objective",
    "kl_opt_sd": "sampled: the same for kl_opt",
}


# ----------------------------------------------------------------------------- an audit folder (KLAudit, kl-bench audit)
# audit.csv: one row per audited step and KL term (docs/audit.md); the fields of kl_bench.audit.StepAudit.
AUDIT_COLUMNS: dict[str, str] = {
    "step": "the trainer's global step",
    "source": "which KL term: e.g. 'kl' (the kl TRL logs), 'loss' (GRPO's KL term as its loss_type aggregates it), "
              "'reward' (RLOO's KL in the reward)",
    "estimator": "the registry name of the trainer's per-token formula (e.g. trl.grpo, k1)",
    "aggregation": "token-mean, seq-mean-token-mean or seq-mean-token-sum",
    "sequences": "sequences audited (all ranks)",
    "tokens": "masked tokens audited (all ranks)",
    "logged": "the trainer's estimate: its own per-token values under its aggregation",
    "recomputed": "the same formula on float64 log-probs of the sampled tokens from the audited logits",
    "exact": "Σ w KL(q‖p) over the positions: the value the estimate is for",
    "expected_q": "Σ w E_q[f]: the estimate's expectation were tokens drawn from q",
    "expected_b": "Σ w E_b[f]: its expectation under the sampler b that drew them",
    "se": "standard error of the noise, √Σ w² Var_b[f] (exact conditional variances)",
    "bias": "logged − exact",
    "z": "bias / se",
    "bias_estimator": "expected_q − exact (the formula's own bias; 0 for k1, k3)",
    "bias_sampler": "expected_b − expected_q (temperature, top-k, top-p, min-p, ...)",
    "bias_precision": "Σ w f(the trainer's own log r) − recomputed: rounding of its log-probs (all of logged − "
                      "recomputed where its formula fits)",
    "noise": "recomputed − expected_g (sampling noise, mean 0, SD se)",
    "frac_negative": "fraction of the trainer's per-token values below 0",
    "p_negative": "exact token average of P_b(f < 0)",
    "miss": "token average of the q-mass b can never draw",
    "consistency_z": "z of Σ(log g(x) − E_g log g): ≈ N(0,1) when tokens came from the audited g; −inf: g(x) = 0",
    "impossible": "sampled tokens with g(x) = 0 under the audited logits",
    "consistency_sum": "Σ (log g(x) − E_g log g) (pooled across steps)",
    "consistency_var": "Σ Var_g[log g] (pooled across steps)",
    "expected_g": "Σ w E_g[f]: its expectation under the distribution that drew the tokens (the sampler on the "
                  "sampling pass's logits; = expected_b when that pass was not captured)",
    "bias_mismatch": "expected_g − expected_b (the sampling pass differs from the scored one: dropout, position ids, "
                     "a cache, precision); 0 when not measured",
    "sampling_pass": "tokens whose sampling pass was captured (0: bias_mismatch not measured, it is in the noise)",
    "bias_formula": "logged − Σ w f(the trainer's own log r): its values are not its declared formula of its own "
                    "log-probs; 0 where the dtype explains the gap (then all of it is bias_precision)",
    "formula_fit": "which formula the trainer's values fit (kl_bench.audit.step.FORMULAS): 0 the declared one, 1 it "
                   "of log q − log p (sign swapped), 2/3 k1, 4/5 k2, 6/7 k3 of log p − log q / log q − log p, −1 none",
    "own_logprobs": "tokens with the trainer's own log-probs (0: its log r emulated at the dtype of its values)",
}


# engine.csv: the rollout engine's mismatch per step (kl_bench.audit.rollout_engine), when the trainer holds its log-probs.
ENGINE_COLUMNS: dict[str, str] = {
    "step": "the trainer's global step", "tokens": "masked tokens with the engine's log-probs",
    "outside": "sampled tokens the settings' sampler on the trainer's logits cannot draw (the engine's own truncation "
               "kept them: its logits differ)",
    "outside_beyond": "of those, the tokens further below the sampler's threshold than float32 rounding",
    "outside_depth": "how far below the threshold the deepest lies, in score units (−inf: none)",
    "spread": "SD of e − log b (processed) or e − log q (raw) at the tokens b can draw: the engine's log-prob noise",
    "convention": "the engine's log-probs: raw (the full distribution), processed (after truncation), either",
    "engine_dtype": "the dtype the engine declared (bfloat16, float16, float32, float64; empty: not declared)",
    "sampler_gap": "token mean of log b(x) − log q(x), exact: what a processed engine adds from the sampler alone",
    "kl_engine": "KL(engine‖trainer) measured: mean(e − log q) processed, mean(e − log q + log b − log q) raw",
    "kl_engine_se": "its SE (clustered by sequence)",
    "kl_sampler": "token mean of KL(b‖q), exact: KL(engine‖trainer) were the engine the sampler on the trainer's logits",
    "kl_excess": "kl_engine − kl_sampler: the engine beyond its sampler",
    "kl_drawn": "token mean of KL(g‖q), exact, where the drawing pass's hidden states were given (NaN otherwise)",
    "excess_k3": "mean k3(ℓ − e) at the tokens b can draw (ℓ = log b processed, log q raw): ≈ KL(engine‖b), the "
                 "engine beyond its sampler with power", "excess_k3_se": "its SE",
    "excess_k3_exact": "0: its value were the engine the sampler on the trainer's logits",
    "kl": "verl rollout_corr/kl: mean(e − log q) over the tokens", "kl_se": "its SE (clustered by sequence)",
    "kl_exact": "its value were the engine the sampler on the trainer's logits: KL(b‖q) processed, 0 raw",
    "k3_kl": "verl rollout_corr/k3_kl: mean(ρ − 1 − log ρ), ρ = q/e", "k3_kl_se": "its SE",
    "k3_kl_exact": "KL(b‖q) − the q-mass b never draws (E_b[ρ] = Σ_{b>0} q < 1 under truncation), token mean; 0 raw",
    "chi2": "verl rollout_corr/chi2_token: mean(ρ²) − 1", "chi2_se": "its SE",
    "chi2_exact": "token mean of χ²(q‖b) = Σ_{b>0} q²/b − 1; 0 raw",
    "logp_diff": "TRL sampling/sampling_logp_difference/mean: mean |log q − e|", "logp_diff_se": "its SE",
    "logp_diff_exact": "token mean of E_b|log b − log q| if processed, 0 if raw",
    "logp_diff_max": "TRL sampling/sampling_logp_difference/max over this process's audited tokens",
    "env_kl": "how far float32 rounding of the engine's log-probs moves kl and logp_diff (token mean)",
    "env_k3_kl": "the same for k3_kl", "env_chi2": "the same for chi2", "env_excess_k3": "the same for excess_k3",
    "cause": "what fits a departure: sampler, precision, version, precision or version (empty: none)",
}
# Columns of older engine.csv files than today's, with what they stand for there (as AUDIT_DEFAULTS).
ENGINE_DEFAULTS: dict[str, str] = {"outside_beyond": "outside", "outside_depth": "nan", "spread": "nan",
                                   "engine_dtype": "", "kl_engine": "kl", "kl_engine_se": "kl_se",
                                   "kl_sampler": "kl_exact", "kl_excess": "nan", "kl_drawn": "nan", "excess_k3": "nan",
                                   "excess_k3_se": "nan", "excess_k3_exact": "0.0", "env_excess_k3": "0.0", "env_kl": "0.0",
                                   "env_k3_kl": "0.0", "env_chi2": "0.0", "cause": ""}


# Columns of older audit.csv files than today's, with what they stand for there: a number, or another column's
# values (expected_g: the sampler's expectation expected_b, where the sampling pass was not captured).
AUDIT_DEFAULTS: dict[str, str] = {"bias_mismatch": "0.0", "sampling_pass": "0", "expected_g": "expected_b",
                                  "bias_formula": "0.0", "formula_fit": "0", "own_logprobs": "0"}


# ----------------------------------------------------------------------------- run.json (every kind)
# The envelope's fields: key → meaning. kl_bench.results.folders writes "files" and the kind's version key;
# the writers give the rest (tests/test_folders.py checks that each writes only fields described here).
COMMON_ENVELOPE: dict[str, str] = {
    "created": "when the folder was written: UTC, ISO 8601, to the second",
    "files": "data file name → its sha256 (hex): every data file, checked on every read",
    "dropped": "data files left out of this copy (name → sha256, checked if one is put back): the committed "
               "results/ keep no per-draw reservoir (reservoir.npz); a report of the folder skips its ECDF figures",
}
SPEC_ENVELOPE: dict[str, str] = {
    "spec_path": "the spec file as given (or '<dict>' for a spec given as a dict)",
    "spec_sha256": "sha256 of the spec's canonical form: what a baseline and a checkpoint are matched by",
    "spec_text": "the spec's text, verbatim",
    "experiment": "[experiment] name", "seed": "the run's seed (after --seed)",
    "device": "the device the draws were made on (cpu, cuda, cuda:N)", "device_name": "that device's name",
    "versions": "python, kl-bench, torch, numpy, scipy, pandas versions",
    "git_commit": "kl-bench's git commit when run from a checkout, else null",
    "wall_seconds": "wall time of the whole run, s", "world_size": "processes that drew the draws (torchrun)",
}
RUN_ENVELOPE: dict[str, str] = {
    "kl_bench_run": "the results format version (FORMAT_VERSION)", **COMMON_ENVELOPE, **SPEC_ENVELOPE,
    "draws_per_case": "case → draws (after --draws)", "batches": "batches per case (batch means behind each SE)",
    "resumed": "whether the run continued from a checkpoint (--resume)",
    "rank_batches": "per case and pass, the [lo, hi) batch ranges each rank drew",
    "sampling_seconds": "this process's sampling time, s (restored draws took none)",
    "draws_per_second": "this process's draws / sampling_seconds", "restored_draws": "draws restored from a checkpoint",
    "cases": "case → its kind's metadata (description, sizes, sampler) and its sampling seconds",
}
TRAIN_ENVELOPE: dict[str, str] = {
    "kl_bench_train": "the training folder's format version", **COMMON_ENVELOPE, **SPEC_ENVELOPE,
    "train": "[train]: optimizer, lr, steps, beta, gradients, draws per step, seeds, reward (kind, function), "
             "combinations",
}
AUDIT_ENVELOPE: dict[str, str] = {
    "kl_bench_audit": "the audit folder's format version", **COMMON_ENVELOPE,
    "columns": "audit.csv's columns with their meanings (AUDIT_COLUMNS)",
    "engine_columns": "engine.csv's columns with their meanings, when the folder has one (ENGINE_COLUMNS)",
    "pooled": "per source (KL term): steps, mean bias, its SE, pooled z, consistency z, impossible tokens",
    # the TRL callback's settings (kl_bench.integrations.trl.KLAudit)
    "trainer": "the trainer's class name", "trl": "TRL's version", "sampler": "the generation sampler audited",
    "every": "audited every N optimizer steps", "max_rows": "sequences audited per step and process",
    "steps_saved": "whether steps were saved for `kl-bench audit` (save_steps)",
    "notes": "the settings the callback warned about, [key, message] each (dropout, bf16 autocast, unmodelled "
             "generation options, num_iterations): `kl-bench audit` says them again",
    # kl-bench audit DIR
    "source_folder": "the folder of saved steps that was audited",
}
