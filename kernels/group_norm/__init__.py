"""GroupNorm (+ channel bias, residual, SiLU, return_sum) for NCHW and channels_last tensors, one module per concept:

* ``ref``: :func:`group_norm_ref`, the plain-PyTorch reference with the same fusions;
* ``plan``: launch planning for the Triton kernels (:func:`group_norm_plan`, :class:`GroupNormPlan`, ``TUNING``);
* ``triton_groups``: the group-aligned Triton kernels ("onepass", "twopass"; either layout) and their launch;
* ``triton_nhwc``: the channel-tile Triton kernels for channels_last ("nhwc_tiles") and their launch;
* ``cluster`` (+ ``cluster.cu``): the sm_90 CUDA C++ thread-block-cluster kernels, their plans and loader;
* ``op``: :func:`group_norm`, the checks, the ``torch.ops.sdfast.group_norm`` custom op and the cluster/Triton
  choice.
"""

from kernels.group_norm.op import group_norm
from kernels.group_norm.plan import GroupNormPlan, group_norm_plan
from kernels.group_norm.ref import ACTIVATIONS, group_norm_ref

__all__ = ["group_norm", "group_norm_ref", "group_norm_plan", "GroupNormPlan", "ACTIVATIONS"]
