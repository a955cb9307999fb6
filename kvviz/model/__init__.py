"""A real model in the loop: the loop, generation, the pass-key test, capture and `kvviz.hf`.

Loading and running a model needs the `model` extra (`pip install 'kvviz[model]'`: torch,
transformers and the model files' readers); torch and transformers are imported where a model
runs, never here, so the explorer can read saved loop and pass-key results through this
package without them. What needs a model refuses in one line naming the extra (`kvviz.hf` on
import, the commands before they load one)."""
