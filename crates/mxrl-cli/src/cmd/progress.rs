//! An indicatif progress bar (bytes, bytes/s, ETA) behind the library's `Progress` trait.

use indicatif::{ProgressBar, ProgressStyle};

/// A byte progress bar; hidden automatically when stderr is not a terminal.
pub struct Bar {
    bar: ProgressBar,
}

impl Bar {
    /// A bar labelled `what`, started when the work size is known.
    pub fn new(what: &str) -> Self {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(
                "{msg} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}",
            )
            .expect("valid template")
            .progress_chars("=> "),
        );
        bar.set_message(what.to_string());
        Bar { bar }
    }

    /// Removes the bar from the terminal.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl mxrl_ckpt::Progress for Bar {
    fn start(&self, total: u64) {
        self.bar.set_length(total);
        self.bar.reset();
    }
    fn advance(&self, bytes: u64) {
        self.bar.inc(bytes);
    }
}
