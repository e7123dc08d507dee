"""Given experiment code of the chapters, hand-written: the plots, interactive views and
measurements a chapter runs but whose reading is not its lesson (one module per chapter, and the
views' widget helper in `views`). A notebook imports them and keeps in its cells the calls and the
code whose reading is the lesson. Nothing here is imported to run a model; the exercises and the
helpers the chapters export are in `qwen_mini.course.lab`."""
