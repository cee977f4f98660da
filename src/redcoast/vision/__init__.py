"""Images and chat records with images to rows for vision-language models (`rc.models.Llava`).

`ImageProcessor` makes an image's pixels as `transformers`' image processors make
them (CLIP's, SigLIP's and Gemma 3's, the Pillow ones, to the bit), read from a
checkpoint's `preprocessor_config.json` or built in code; `preprocess` stacks a
sequence's images into its `pixel_values`. `ImageTokens` says how a model's prompts
hold images (the placeholder a chat template writes, and the tokens the model's
processor puts in its place: LLaVA's `<image>` repeated `config.image_tokens`
times, Gemma 3's `<start_of_image>` and 256 soft tokens); `expand_images` does the
same to ids.

`chat_rows` turns chat records with images (`{"images": [...], "messages": [...]}`,
the layout TRL's vision SFT reads) into fixed-length rows in memory: the chat
template applied, placeholders expanded, the loss on the assistant's turns only (as
`rc.text.tokenize_instructions` counts them), padded as `rc.text.padded` pads, and
each row's images read when the row is. `collate` stacks rows, and
`rc.models.lm_loss` gives the model each row's `pixel_values`: with them, `rc.fit`
trains a LLaVA.

Pillow reads the images; it is imported on first use (`pip install
'redcoast[vision]'`), so `import redcoast` does not need it.
"""

from ._image import ImageProcessor as ImageProcessor
from ._image import preprocess as preprocess
from ._rows import ImageRows as ImageRows
from ._rows import chat_rows as chat_rows
from ._rows import collate as collate
from ._tokens import ImageTokens as ImageTokens
from ._tokens import expand_images as expand_images
