fn main() { println!("memattn"); }
