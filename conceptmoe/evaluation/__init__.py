"""Measuring trained runs: ``evaluate`` (a run on its held-out split), ``compare`` (MoE vs
compute-matched ConceptMoE on paired seeds, with its report and plots), ``boundaries`` (where
the router puts concept boundaries, text and image+text) and ``continual`` (the paper's
continual-training comparison: a MoE continued as itself or converted). Sits above training/.
"""
